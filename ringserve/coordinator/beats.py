"""The Heartbeats stream: a worker's heartbeats on one long-lived stream instead of a unary call each.

Why a stream: at 2,000 workers beating once a second, grpcio's cost of a unary call (a new call
object, its metadata, the interceptor, a task, the status at the end) was about 90% of the
coordinator's CPU per heartbeat and saturated its core. A message on an open stream skips all of
that: it is a read and a write on a call that already exists (measured in benchmarks/
coordinator_scale.py, which compares the two on one coordinator).

Each request is answered by exactly the answer the unary Heartbeat would give, in order, so
that the client can wait for the answer to its one request in flight with its own deadline.

Bounds, so that a flood of streams cannot starve the members (whose clients fall back to unary
heartbeats while refused a stream, see ringserve.worker.control.client):
- at most ``heartbeat_stream_cap`` streams at once (RESOURCE_EXHAUSTED past it);
- one stream per worker id: the newest wins, and the older one ends with ABORTED on its next
  request (a worker that re-opened its stream after a network fault must not be refused
  because its old stream is not yet known dead);
- a stream that names a worker the coordinator does not know is answered (``known: false``)
  and ended, so that strangers hold no slot; the worker rejoins, then opens a new stream;
- a stream that sends nothing for the heartbeat timeout is ended (DEADLINE_EXCEEDED): by then
  its worker is dead to the coordinator anyway, so the slot is free again for real workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from ringserve._proto import coordinator_pb2 as pb


class HeartbeatStreams:
    """The open Heartbeats streams: how many, and which one currently speaks for each worker id."""

    def __init__(self, cap: int, idle_s: float) -> None:
        self.cap = cap
        self.idle_s = idle_s
        self.open = 0
        self._owners: dict[str, object] = {}

    def owner(self, worker_id: str) -> object | None:
        return self._owners.get(worker_id)

    async def serve(
        self, context: grpc.aio.ServicerContext, beat: Callable[[pb.HeartbeatRequest], pb.HeartbeatResponse]
    ) -> None:
        """Answers each request on the stream with ``beat(request)`` until the stream ends.

        Raises:
            grpc.aio.AbortError: the stream was refused or ended with a status (see the module).
        """
        if self.open >= self.cap:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"The coordinator already serves {self.open} heartbeat streams, its cap (max_heartbeat_streams, "
                f"at most a quarter of max_concurrent_rpcs); send unary Heartbeat calls instead.",
            )
        self.open += 1
        me = object()
        worker_id: str | None = None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.idle_s) as deadline:
                while True:
                    request = await context.read()
                    if request is grpc.aio.EOF:
                        return
                    assert isinstance(request, pb.HeartbeatRequest)
                    if worker_id is not None:
                        if request.worker_id != worker_id:
                            await context.abort(
                                grpc.StatusCode.INVALID_ARGUMENT,
                                f"A heartbeat stream speaks for one worker ({worker_id!r}); a request "
                                f"named {request.worker_id!r}.",
                            )
                        if self._owners.get(worker_id) is not me:
                            await context.abort(
                                grpc.StatusCode.ABORTED,
                                f"A newer heartbeat stream of worker {worker_id!r} replaced this one.",
                            )
                    answer = beat(request)
                    if worker_id is None and answer.known:
                        worker_id = request.worker_id
                        self._owners[worker_id] = me
                    await context.write(answer)
                    if not answer.known:
                        return  # the worker rejoins and opens a new stream; a stranger holds no slot
                    deadline.reschedule(loop.time() + self.idle_s)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"No heartbeat on this stream for {self.idle_s:g} s (the heartbeat timeout).",
            )
        finally:
            self.open -= 1
            if worker_id is not None and self._owners.get(worker_id) is me:
                del self._owners[worker_id]
