"""The worker's channels to its peers: one per address, shared, and closed once nobody uses it.

Everything that talks to a peer (a plane's links, the exclusion check's ``Peer/Latest`` calls)
takes a *lease* on the peer's channel and gives it back when done. A channel without leases is
idle, and ``sweep`` closes the idle ones; it runs after each heartbeat and after each break in the
view watch, so the channel to a peer that left (or that this worker no longer sends to) goes
within a heartbeat of its last stream, and a view change that keeps the peer (the old plane's link
still draining, the new plane's already open) never closes and reopens its connection.

This cache is the one owner of the channels. ``sweep`` takes every idle channel out of the cache
before it awaits any close, so a lease taken meanwhile, from another loop, gets a new channel,
never one being closed (two loops once popped the cache across awaits, and a probe's channel could
close under it).

Example:
    ```python
    cache = ChannelCache(lambda address: grpc.aio.insecure_channel(address))
    lease = cache.lease("10.0.0.2:4000")
    ...  # lease.channel
    lease.release()
    await cache.sweep()   # closes the channel: no lease is left
    ```
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc


class Lease:
    """One user's hold on a channel; ``release`` gives it back (once: later calls do nothing)."""

    __slots__ = ("_cache", "address", "channel", "metadata")

    def __init__(self, cache: ChannelCache, address: str, channel: grpc.aio.Channel) -> None:
        self._cache: ChannelCache | None = cache
        self.address = address
        self.channel = channel
        self.metadata = cache.metadata()  # what a client stream on the channel sends itself (the token)

    def release(self) -> None:
        cache, self._cache = self._cache, None
        if cache is not None:
            cache._release(self)


class ChannelCache:
    """Channels by address, made by ``make`` on first lease, closed by ``sweep`` once idle;
    ``metadata``: what a client stream on them must send itself (Security.call_metadata)."""

    def __init__(self, make: Callable[[str], grpc.aio.Channel],
                 metadata: Callable[[], tuple[tuple[str, str], ...]] = tuple) -> None:
        self._make = make
        self.metadata = metadata
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._leases: dict[str, int] = {}
        self._closed = False

    @property
    def addresses(self) -> set[str]:
        """The addresses a channel is open to."""
        return set(self._channels)

    def lease(self, address: str) -> Lease:
        """A hold on the channel to ``address`` (made now if there is none).

        Raises:
            RuntimeError: the cache is closed (the worker is shutting down).
        """
        if self._closed:
            raise RuntimeError("The worker's channels are closed.")
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._make(address)
        self._leases[address] = self._leases.get(address, 0) + 1
        return Lease(self, address, channel)

    @contextmanager
    def leased(self, address: str) -> Iterator[grpc.aio.Channel]:
        """``with cache.leased(address) as channel:``, released at the end of the block."""
        lease = self.lease(address)
        try:
            yield lease.channel
        finally:
            lease.release()

    async def sweep(self) -> None:
        """Closes every channel that no lease holds."""
        idle = [a for a in self._channels if not self._leases.get(a)]
        channels = [self._channels.pop(a) for a in idle]  # out of the cache before any await
        for channel in channels:
            await channel.close()

    async def close(self) -> None:
        """Closes every channel, leased or not (the worker is shutting down)."""
        self._closed = True
        channels = list(self._channels.values())
        self._channels.clear()
        self._leases.clear()
        for channel in channels:
            await channel.close()

    def _release(self, lease: Lease) -> None:
        count = self._leases.get(lease.address, 0) - 1
        if count > 0:
            self._leases[lease.address] = count
        else:
            self._leases.pop(lease.address, None)
