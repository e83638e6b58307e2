"""The coordinator's probes of suspect workers: the effect of membership's ``Probe`` action.

A peer reported a worker as unreachable, or the worker was silent for the heartbeat timeout; the
coordinator dials that worker's health service, and the answer (alive or not) goes back to the
state machine as a ``ProbeResult``. A process that is gone refuses the dial at once; one that is
stopped or starved has its connection accepted by its kernel, and answers once it runs again, or
not within the probe's deadline. Each probe is a task owned here, cancelled and awaited at
``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.constants import PROBE_TIMEOUT_MAX_S
from ringserve.coordinator import membership
from ringserve.security import Security

log = logging.getLogger("ringserve.coordinator")

__all__ = ["Prober"]

OnResult = Callable[[membership.ProbeResult], None]

# How gRPC core words the OS's ECONNREFUSED ("failed to connect to all addresses; last error:
# UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote host: Connection refused", grpcio
# 1.85): nothing listens at the address, so the process is gone. A name not resolved ("errors
# resolving ...") is UNAVAILABLE too, and proves nothing about a worker that heartbeats.
REFUSED = "Connection refused"


class Prober:
    """Probes suspects, one task each, and reports each answer through ``on_result``.

    Args:
        security: the job's TLS and token, to dial a worker's peer server with.
        heartbeat_timeout_s: the job's heartbeat timeout; a probe waits at most half of it.
        on_result: told the probe's answer (``Probe.result``) when it ends.
    """

    def __init__(self, security: Security, heartbeat_timeout_s: float, on_result: OnResult) -> None:
        self._security = security
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_result = on_result
        self.timeout_s = min(PROBE_TIMEOUT_MAX_S, heartbeat_timeout_s / 2)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """The probes in flight."""
        return len(self._tasks)

    def start(self, probe: membership.Probe) -> None:
        """Starts probing ``probe``'s worker."""
        task = asyncio.get_running_loop().create_task(self._probe(probe), name="ringserve-probe")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, probe: membership.Probe) -> None:
        """Asks a suspect's health service whether it still answers, within timeout_s."""
        alive = timed_out = refused = False
        timeout_s = probe.timeout_s if probe.timeout_s > 0 else self.timeout_s
        try:
            async with self._security.channel(probe.address) as channel:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=timeout_s
                )
                alive = answer.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as exc:
            # No answer in time (a stopped process: its kernel accepted the connection) is not
            # a refusal (nothing listens: the process is gone); a silent or swept worker is
            # removed only for the second.
            timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            refused = exc.code() == grpc.StatusCode.UNAVAILABLE and REFUSED in (exc.details() or "")
        except Exception as exc:  # a worker whose address cannot even be dialled is not answering
            log.warning("probe of worker %s at %r could not start: %s", probe.worker_id, probe.address, exc)
        why = ("silent for the heartbeat timeout" if probe.silent else
               "swept after a death" if probe.sweep else "reported by a peer")
        outcome = "alive" if alive else "no answer in time" if timed_out else "refused" if refused else "dead"
        log.info("probe of worker %s at %s (%s): %s", probe.worker_id, probe.address, why, outcome)
        if alive and not probe.silent and not probe.sweep:
            log.warning(
                "worker %s answers the coordinator but a peer cannot reach it: re-forming the ring, and "
                "dropping a worker if a link is still down in %g s", probe.worker_id, self._heartbeat_timeout_s,
            )
        self._on_result(probe.result(alive, timed_out=timed_out, refused=refused))

    async def close(self) -> None:
        """Cancels the probes in flight and waits for them to end."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
