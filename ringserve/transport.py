"""gRPC plumbing shared by the coordinator and the workers: channel and server options, and the
translation of ``grpc.aio.AioRpcError`` into ringserve's errors at the boundary."""

from __future__ import annotations

import grpc

from ringserve.errors import (
    CoordinatorUnreachableError,
    PeerUnavailableError,
    RingserveError,
)

# Keepalive is explicit so a peer that stops answering without closing its socket (SIGSTOP, a dead
# link) is noticed by the transport too, not only by heartbeats.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# HTTP/2 streams one connection may hold open at once; further ones wait on the client's side.
# Servers also cap RPCs across all connections (max_concurrent_rpcs in the configs), answering
# RESOURCE_EXHAUSTED beyond it, so a flood of streams cannot exhaust a server's memory.
MAX_STREAMS_PER_CONNECTION = 256


MIN_KEEPALIVE_MS = 1_000  # a floor under keepalive_for's bounds: a ping's answer may queue behind data


def keepalive_for(silence_s: float) -> tuple[int, int]:
    """Keepalive (ping after, answer within; milliseconds) that notices a silent connection within
    about ``silence_s``: a channel to a ring peer takes the heartbeat timeout the coordinator
    handed out, so a partition that leaves both ends alive (a blackholed route, which no FIN or
    RST ever reports) breaks the data plane's stream within the bound in which a silent worker is
    declared dead, not the fixed 15 s the defaults give (issue 40: a partition over the payload
    lane took 17 s to be noticed). Half the bound each, and never under MIN_KEEPALIVE_MS."""
    half = max(MIN_KEEPALIVE_MS, round(silence_s * 1000 / 2))
    return half, half


def _common_options(max_message_bytes: int, lookahead_bytes: int | None = None,
                    keepalive: tuple[int, int] = (KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS)) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive[0]),
        ("grpc.keepalive_timeout_ms", keepalive[1]),
        ("grpc.keepalive_permit_without_calls", 1),
        # Loopback and LAN links: a large window keeps chunks flowing without stalls.
        ("grpc.http2.lookahead_bytes", lookahead_bytes or 4 * max_message_bytes),
    ]


# A channel to the coordinator dials again at most this long after a failed dial. gRPC's own
# backoff grows to 120 s: a worker whose coordinator was down for a few seconds (a restart) then
# dialled it again only after its peers had rejoined without it, and was left out of the view the
# restarted coordinator rebuilt (issue 40: ExcludedError after the fifth restart in a row).
MAX_RECONNECT_BACKOFF_MS = 1_000


def control_channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Options of a channel to the coordinator: channel_options, with a reconnect backoff held
    under MAX_RECONNECT_BACKOFF_MS."""
    return [*channel_options(max_message_bytes), ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def channel_options(max_message_bytes: int, *, lookahead_bytes: int | None = None,
                    keepalive: tuple[int, int] = (KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS)) -> list[tuple[str, int]]:
    """Channel options; ``lookahead_bytes``: how far ahead a stream reads (four messages by default);
    ``keepalive``: ping after, answer within (ms; see keepalive_for). Servers take pings at any
    rate (max_ping_strikes 0), so a channel may ping more often than they do."""
    return [*_common_options(max_message_bytes, lookahead_bytes, keepalive), ("grpc.http2.max_pings_without_data", 0)]


def server_options(
    max_message_bytes: int, *, idle_timeout_s: float | None = None, handshake_timeout_s: float | None = None,
    lookahead_bytes: int | None = None,
) -> list[tuple[str, int]]:
    """Server options; ``idle_timeout_s`` closes connections that carry no RPC for that long (an
    open stream keeps its connection busy, however quiet), and ``handshake_timeout_s`` closes
    those that do not finish their TLS handshake and HTTP/2 settings within it (a raw socket
    that sends nothing); ``lookahead_bytes`` as for channel_options."""
    options = [
        *_common_options(max_message_bytes, lookahead_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]
    if idle_timeout_s is not None:
        options.append(("grpc.max_connection_idle_ms", max(1, round(idle_timeout_s * 1000))))
    if handshake_timeout_s is not None:
        options.append(("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout_s * 1000))))
    return options


def coordinator_error(exc: grpc.aio.AioRpcError, address: str, deadline_s: float) -> RingserveError:
    """Maps a failed control-plane call to a ringserve error naming the coordinator."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        # UNAVAILABLE: refused or dropped, whenever it came; only a deadline names its wait.
        return CoordinatorUnreachableError(address, deadline_s, f"{code.name}: {exc.details()}",
                                           waited=code == grpc.StatusCode.DEADLINE_EXCEEDED)
    return RingserveError(f"The coordinator at {address} answered {code.name}: {exc.details()}")


def peer_error(exc: grpc.aio.AioRpcError, address: str) -> PeerUnavailableError:
    return PeerUnavailableError(
        f"The peer at {address} dropped the stream ({exc.code().name}: {exc.details()})."
    )
