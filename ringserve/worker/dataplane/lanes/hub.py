"""A worker's payload lanes (lanes/tcp/outbound.py), in one place: its payload port, the lanes its links
offer, the lanes it dials as a receiver, and the fallbacks, logged once per edge and counted.

The planes (registry.py) hold one ``Lanes``; the links get their ``OutboundLane`` from it, and the
peer server (peers.py) its ``InboundLane`` for each verified stream that offers one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ringserve._proto import peer_pb2
from ringserve.config import WorkerConfig
from ringserve.errors import PayloadLaneError
from ringserve.observe import Counters
from ringserve.security import Security
from ringserve.worker.dataplane.inbox import Received
from ringserve.worker.dataplane.lanes.tcp.inbound import InboundLane, LaneBuffers
from ringserve.worker.dataplane.lanes.tcp.outbound import OutboundLane
from ringserve.worker.dataplane.lanes.tcp.server import LaneServer, client_context, server_context

log = logging.getLogger("ringserve.worker")


def _drop(_: object) -> None:
    pass


def split_host(address: str) -> str:
    """The host of ``host:port`` (an IPv6 host without its brackets)."""
    return address.rpartition(":")[0].strip("[]")


class Lanes:
    """A worker's payload lanes: its payload port, the lanes its links offer, those it dials as a
    receiver, and the fallbacks, logged once per edge."""

    def __init__(self, config: WorkerConfig, counters: Counters, *, tag: Callable[[], str]) -> None:
        self.config = config
        self.counters = counters
        self.mode = config.payload_lane
        self._tag = tag
        self._security: Security | None = None
        self._server: LaneServer | None = None
        self._unbound = ""  # why the payload port could not be bound (auto: no lanes are offered)
        self._logged: set[str] = set()
        self.buffers = LaneBuffers(config.frame_bytes)

    @property
    def security(self) -> Security:
        """The worker's TLS material (read from the config's files when first needed)."""
        if self._security is None:
            self._security = Security.load(self.config)
        return self._security

    @property
    def required_within_s(self) -> float:
        """How long a required lane (``tcp``) may take to attach: the receiver's HELLO deadline, then
        its connect deadline; 0 when the lane is not required."""
        cfg = self.config
        return cfg.peer_hello_timeout_s + cfg.payload_connect_timeout_s if self.mode == "tcp" else 0.0

    @property
    def server(self) -> LaneServer | None:
        return self._server

    def outbound(self) -> OutboundLane | None:
        """A lane for a new link to offer; None when lanes are off (or the port could not be bound).

        Raises:
            PayloadLaneError: the lane is required (``tcp``) and the payload port could not be bound.
        """
        if self.mode == "off":
            return None
        server = self._listen()
        if server is None:
            return None
        cfg = self.config
        lane = OutboundLane(self.counters, port=cfg.payload_advertise_port or server.port, tls=server.tls,
                            withdraw=server.withdraw, required_within_s=self.required_within_s)
        server.offer(lane)
        return lane

    def _listen(self) -> LaneServer | None:
        if self._server is not None or self._unbound:
            return self._server
        cfg = self.config
        try:
            self._server = LaneServer(cfg.bind_host, cfg.payload_port, context=server_context(self.security),
                                      hello_timeout_s=cfg.peer_hello_timeout_s, cap=cfg.max_unverified_streams,
                                      counters=self.counters, tag=self._tag, congestion=cfg.payload_congestion)
        except OSError as exc:
            where = f"{cfg.bind_host}:{cfg.payload_port}"
            if self.mode == "tcp":
                raise PayloadLaneError(f"The payload port {where} (RINGSERVE_PAYLOAD_PORT) could not be bound: {exc}; "
                                       f"RINGSERVE_PAYLOAD_LANE=tcp requires it.") from exc
            self._unbound = str(exc)
            log.warning("%s: the payload port %s could not be bound (%s); every payload travels over the stream",
                        self._tag(), where, exc)
        return self._server

    def inbound(self, offer: peer_pb2.PayloadLane, *, address: str, edge: str,
                on_frame: Callable[[Received], None] = _drop, on_broken: Callable[[BaseException], None] = _drop,
                ) -> InboundLane | None:
        """Dials the lane a HELLO offers (at the host of the sender's ``address``), whose frames go
        to ``on_frame`` once it is attached (``on_broken``: it broke); None when this worker keeps
        the stream for it (lanes off, or a TLS mismatch: refused with a reason).

        Raises:
            PayloadLaneError: the lane is required (``tcp``) and the TLS settings disagree.
        """
        if self.mode == "off":
            return None
        host = split_host(address)
        context = client_context(self.security)
        where = f"{host}:{offer.port}"
        if offer.tls != (context is not None):
            if context is not None:
                why = (f"it offers a plaintext lane at {where} and this worker runs with TLS: a TLS job's payloads "
                       "never travel in plaintext")
            else:
                why = f"its lane at {where} speaks TLS and this worker has no TLS settings (tls_ca)"
            self.fell_back(edge, why, peer=address)
            return None
        return InboundLane(host=host, port=offer.port, token=offer.token, context=context,
                           server_name=self.security.server_name or host, timeout_s=self.config.payload_connect_timeout_s,
                           buffers=self.buffers, max_bytes=self.config.max_message_bytes,
                           fell_back=lambda why: self.fell_back(edge, why, peer=address),
                           attached_late=lambda: log.info("%s: the payload lane of %s attached after all",
                                                          self._tag(), edge),
                           on_frame=on_frame, on_broken=on_broken)

    def fell_back(self, edge: str, why: str, *, peer: str = "") -> None:
        """An edge keeps the stream: counted, and logged once per edge (``tcp``: raised as
        ``missing`` by the stream, see peers.py).

        Raises:
            PayloadLaneError: the lane is required (``tcp``).
        """
        self.counters.lane_fallbacks += 1
        if self.mode == "tcp":
            raise self.missing(edge, why)
        key = peer or edge  # the sending worker, whatever its rank and view: one line per edge
        if key in self._logged:
            log.debug("%s: payloads of %s take the stream: %s", self._tag(), edge, why)
            return
        self._logged.add(key)
        log.warning("%s: payloads of %s take the gRPC stream: %s (logged once per edge; counted in lane_fallbacks)",
                    self._tag(), edge, why)

    def missing(self, edge: str, why: str) -> PayloadLaneError:
        """The error of an edge whose lane is required and did not attach."""
        return PayloadLaneError(f"The payload lane of {edge} could not attach: {why}; RINGSERVE_PAYLOAD_LANE=tcp "
                                f"requires it (open that TCP port between the workers, pin it with "
                                f"RINGSERVE_PAYLOAD_PORT, or set auto).")

    async def close(self) -> None:
        """Closes the payload port (the lanes close with their links)."""
        server, self._server = self._server, None
        if server is not None:
            await server.close()

