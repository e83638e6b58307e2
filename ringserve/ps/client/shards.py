"""A client's links to the shards: where each is (the coordinator's directory), its channel, what
the client last saw of it, and the translation of a shard's errors into ringserve's.

A link follows its shard through restarts. When a call fails because the shard is gone
(UNAVAILABLE, or a stream cut: see verdicts.py for how these are told from the shard's own
refusals), ``ShardLinks.recover`` asks the directory until the shard's index is listed alive again,
within ``shard_wait_s``, and redials if its address changed. A shard that came back as a new
incarnation may hold an older version than the client saw: the client then sends the version it
saw once (so the shard counts what its restart lost) and pulls everything again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from ringserve._proto import coordinator_pb2 as cpb
from ringserve._proto import coordinator_pb2_grpc as cpb_grpc
from ringserve._proto import ps_pb2_grpc as pb_grpc
from ringserve.config import PSClientConfig
from ringserve.errors import (
    CollectiveTimeoutError,
    CoordinatorUnreachableError,
    InvalidArgumentError,
    RingserveError,
    ShardUnavailableError,
)
from ringserve.ps.layout import Piece
from ringserve.security import Security
from ringserve.transport import channel_options, control_channel_options, coordinator_error

log = logging.getLogger("ringserve.ps")

# Between two looks at the directory while waiting for shards.
LIST_RETRY_S = 0.1


@dataclass
class ShardLink:
    """One shard as this client knows it."""

    index: int
    address: str = ""
    incarnation: int = 0
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.ParameterServerStub | None = None
    pieces: tuple[Piece, ...] = ()
    version: int = 0        # the newest version seen (pulled, or answered to a push)
    step: int = 0           # the next step to push: sync/average the round, ssp the clock
    pulled: bool = False    # a whole pull of this incarnation is held: later pulls may ask for changes only
    seen_before: int = 0    # the version seen of the shard's earlier incarnation, sent once
    lost_now: int = 0       # the updates the current incarnation reports lost to its restart
    lost_before: int = 0    # those the earlier incarnations reported: a shard counts only its own
    restarts: list[int] = field(default_factory=list)

    @property
    def lost_updates(self) -> int:
        """Every update lost to this shard's restarts, as its incarnations reported them."""
        return self.lost_before + self.lost_now

    def restarted(self, incarnation: int) -> None:
        """The shard is a new incarnation: remember what was seen of the old one."""
        if self.incarnation and incarnation != self.incarnation:
            self.lost_before += self.lost_now
            self.lost_now = 0
            self.seen_before = max(self.seen_before, self.version)
            self.pulled = False
            self.restarts.append(incarnation)
            log.warning("parameter-server shard %d restarted (incarnation %d -> %d); this worker had seen "
                        "version %d", self.index, self.incarnation, incarnation, self.version)
        self.incarnation = incarnation


class ShardLinks:
    """The client's links, and the directory they are found in."""

    def __init__(self, config: PSClientConfig, security: Security) -> None:
        self.config = config
        self.security = security
        self.links: list[ShardLink] = []
        # Made on first use, in the loop that uses it (a client may be built outside it).
        self._channel: grpc.aio.Channel | None = None
        self._directory: cpb_grpc.CoordinatorStub | None = None

    async def list(self) -> cpb.ListShardsResponse:
        if self._directory is None:
            self._channel = self.security.channel(self.config.coordinator, control_channel_options(4 << 20))
            self._directory = cpb_grpc.CoordinatorStub(self._channel)
        try:
            answer = await self._directory.ListShards(cpb.ListShardsRequest(), timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise coordinator_error(exc, self.config.coordinator, self.config.rpc_timeout_s) from None
        assert isinstance(answer, cpb.ListShardsResponse)
        return answer

    async def connect(self) -> int:
        """Waits until the directory lists all S shards alive, and links to them; returns S.

        Raises:
            ShardUnavailableError: not every shard was listed alive within shard_wait_s.
        """
        wait = self.config.shard_wait_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            try:
                listing = await self.list()
            except CoordinatorUnreachableError:
                if loop.time() > deadline:
                    raise
                listing = cpb.ListShardsResponse()
            alive = {e.index: e for e in listing.entries if e.alive}
            if listing.shards and len(alive) == listing.shards:
                break
            if loop.time() > deadline:
                missing = [i for i in range(listing.shards) if i not in alive]
                raise ShardUnavailableError(missing[0] if missing else 0, "", wait,
                                            f"the coordinator lists {len(alive)} of {listing.shards or 'S'} shards alive")
            await asyncio.sleep(LIST_RETRY_S)
        if not self.links:
            self.links = [ShardLink(i) for i in range(listing.shards)]
        for entry in alive.values():
            await self._point(self.links[entry.index], entry)
        return listing.shards

    async def _point(self, link: ShardLink, entry: cpb.ShardEntry) -> None:
        if entry.address != link.address or link.channel is None:
            old = link.channel
            link.address = entry.address
            link.channel = self.security.channel(entry.address, channel_options(self.config.max_message_bytes))
            link.stub = pb_grpc.ParameterServerStub(link.channel)
            if old is not None:
                await old.close()
        link.restarted(entry.incarnation)

    async def recover(self, link: ShardLink, cause: grpc.aio.AioRpcError, started: float) -> None:
        """Waits until the directory lists ``link``'s shard alive again, and points the link at it.

        Raises:
            ShardUnavailableError: not within shard_wait_s of ``started`` (the first failure).
        """
        loop = asyncio.get_running_loop()
        wait = self.config.shard_wait_s
        while True:
            if loop.time() - started > wait:
                raise ShardUnavailableError(link.index, link.address, wait,
                                            f"{cause.code().name}: {cause.details()}")
            await asyncio.sleep(LIST_RETRY_S)
            try:
                listing = await self.list()
            except CoordinatorUnreachableError:
                continue
            entry = next((e for e in listing.entries if e.index == link.index and e.alive), None)
            if entry is not None:
                await self._point(link, entry)
                return

    def stub(self, link: ShardLink) -> pb_grpc.ParameterServerStub:
        assert link.stub is not None, "connect() first"
        return link.stub

    async def close(self) -> None:
        for link in self.links:
            if link.channel is not None:
                await link.channel.close()
                link.channel = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._directory = None


def translate(exc: grpc.aio.AioRpcError, link: ShardLink) -> RingserveError:
    """A shard's refusal as a ringserve error naming the shard (not for transient failures:
    verdicts.is_transient; recover those)."""
    code, details = exc.code(), exc.details() or ""
    where = f"Parameter-server shard {link.index} at {link.address}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(f"{where} refused the call: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeoutError(f"{where}: {details or 'the call passed its deadline'}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return RingserveError(f"{where} refused the job token: {details}")
    return RingserveError(f"{where} answered {code.name}: {details}")
